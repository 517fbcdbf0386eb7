"""torch.ops.attnmerge exists whenever attnmerge and torch are both imported, in either order, and
attnmerge never imports torch itself: registered now if torch is already imported, else right after
torch's own import finishes (a one-shot import hook)."""
import importlib.util
import sys
import warnings

# torch.library.register_fake and Library.impl(with_keyset=True), as _torch_ops uses them.
MIN_TORCH = (2, 4)


def _register():
    try:
        import torch

        if tuple(int(p) for p in torch.__version__.split(".")[:2]) < MIN_TORCH:
            return  # the eager path works as before; torch.compile sees a Python call
        from . import _roads, _torch_ops

        _roads.use_torch(_torch_ops.takes, _torch_ops.run, _torch_ops.transforming)
    except Exception as e:  # never break the user's `import torch`
        warnings.warn(f"attnmerge: torch.ops.attnmerge could not be registered ({type(e).__name__}: {e}); "
                      f"torch.compile and autograd will not see attnmerge's ops", RuntimeWarning, stacklevel=2)


class _AfterTorchImport:
    """A meta path finder that lets the others find torch, then runs _register once torch's
    module has executed."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        _remove()
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


_FINDER = _AfterTorchImport()


def _remove():
    try:
        sys.meta_path.remove(_FINDER)
    except ValueError:
        pass


def install():
    torch = sys.modules.get("torch")
    if torch is None:
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
    elif not getattr(getattr(torch, "__spec__", None), "_initializing", False):
        _register()
    # else: attnmerge is imported from within torch's own import; nothing is registered then
