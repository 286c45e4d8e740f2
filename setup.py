"""jaxhybrid: hybrid data + pipeline parallel training for JAX/Flax."""
from setuptools import find_packages, setup

setup(
    name="jaxhybrid",
    version="0.1.0",
    description="Hybrid data + pipeline parallelism for JAX/Flax, planned from measured costs.",
    packages=find_packages(include=["jaxhybrid", "jaxhybrid.*"]),
    python_requires=">=3.10",
    # Ranges tested: jax 0.10.2, flax 0.12.8, optax 0.2.8, orbax-checkpoint 0.12.8,
    # ml_collections 1.1.0, absl-py 2.5.1, numpy 2.4, scikit-learn 1.9, matplotlib 3.11,
    # pytest 9.0, pytest-xdist 3.8.
    install_requires=[
        "jax>=0.10.0,<0.11",
        "flax>=0.12.0,<0.13",
        "optax>=0.2.5,<0.3",
        "orbax-checkpoint>=0.12.0,<0.13",
        "numpy>=1.26,<3",
        "absl-py>=2.1,<3",
        "ml-collections>=1.0,<2",
        "scikit-learn>=1.5,<2",
        "matplotlib>=3.8,<4",
        "tensorboardX>=2.6,<3",
        "tqdm>=4.66,<5",
    ],
    extras_require={"test": ["pytest>=8,<10", "pytest-xdist>=3.5,<4"]},
)
