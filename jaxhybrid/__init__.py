"""jaxhybrid: hybrid data + pipeline parallel training for JAX/Flax.

    import jaxhybrid as jh
    from jaxhybrid import pipeline as jp
    mesh = jh.make_mesh(data=2, pipe=4)
    pipe = jp.Pipeline(layers, mesh=mesh, num_microbatches=8, schedule="1f1b")
"""
import importlib

from jaxhybrid.mesh import make_mesh

__all__ = ["make_mesh", "pipeline", "plan", "models", "data", "schedules"]
__version__ = "0.1.0"


def __getattr__(name):
    # Subpackages load on first use so that `import jaxhybrid` stays light.
    if name in ("pipeline", "plan", "models", "data", "schedules", "train", "checkpoint"):
        return importlib.import_module(f"jaxhybrid.{name}")
    raise AttributeError(f"module 'jaxhybrid' has no attribute {name!r}")
