"""The native API."""
from . import _C
from ._arrays import default_stream, dtype_name, empty, family


def lse_flags(base):
    """C ABI flags for an LSE base: 'e' (natural log, the default) or 2 (log2-sum-exp2)."""
    if base == "e":
        return 0
    if base == 2 and not isinstance(base, bool):
        return _C.LSE_BASE2
    raise ValueError(f"base: expected 'e' or 2, got {base!r}")


def a_tokens_arg(a_tokens, name="a_tokens"):
    if a_tokens is None:
        return -1
    if not isinstance(a_tokens, int) or isinstance(a_tokens, bool) or a_tokens < 0:
        raise ValueError(f"{name}: expected None or an int >= 0, got {a_tokens!r}")
    return a_tokens


def _shape(x, arg):
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{arg}: expected an array, got {type(x).__qualname__}")
    return tuple(shape)


def _refuse_jax_output(x, arg):
    if x is not None and family(x) == "jax":
        raise ValueError(f"{arg}: expected a writable array, got a JAX array (immutable); leave {arg}=None "
                         f"to get a new JAX array")


def merge(o_a, lse_a, o_b, lse_b, *, out=None, out_lse=None, return_lse=True, out_dtype=None, base="e",
          a_tokens=None, stream=None):
    """Merge two attention states: (out, out_lse) = merge((o_a, lse_a), (o_b, lse_b)).

    o_a, o_b: [tokens, heads, head_size], float32, float16 or bfloat16 (one dtype for both).
    lse_a, lse_b: float32 [tokens, heads], natural log (base="e") or base 2 (base=2); any strides,
        so a [heads, tokens] buffer is passed as its transpose (`lse.T`).
    out: [tokens, heads, head_size] in any of the three dtypes; allocated in the caller's array
        library when None, with dtype `out_dtype` (default: that of o_a).
    out_lse: float32 [tokens, heads], in the input's base; allocated when None and return_lse.
    a_tokens: only the first a_tokens tokens merge a with b; later rows take b alone and a needs
        only a_tokens tokens (vLLM's prefill_tokens_with_context).
    stream: None (the current stream of the arrays' framework, else the legacy default stream), an
        int cudaStream_t, or an object with .cuda_stream or .ptr.  Ignored for host arrays.

    Every array may have any strides >= 0, except that head_size is unit-stride.  Host arrays run
    on the CPU; CUDA arrays on the GPU they live on, asynchronously on `stream` (JAX outputs are
    synchronized before they are returned).  Returns (out, out_lse); out_lse is None when
    return_lse is False and no out_lse was given.
    """
    flags = lse_flags(base)
    a_tok = a_tokens_arg(a_tokens)
    _refuse_jax_output(out, "out")
    _refuse_jax_output(out_lse, "out_lse")
    if out is not None and out_dtype is not None:
        want, got = dtype_name(out_dtype, "out_dtype"), dtype_name(getattr(out, "dtype", None), "out")
        if want != got:
            raise ValueError(f"out_dtype: expected None or the dtype of out ({got}), got {want}")
    out_view, lse_view = out, out_lse
    if out is None or (out_lse is None and return_lse):
        shape = _shape(o_b, "o_b")
        if out is None:
            source = "out_dtype"
            if out_dtype is None:
                source, out_dtype = "o_a", getattr(o_a, "dtype", None)
                if out_dtype is None:
                    raise TypeError(f"o_a: expected an array, got {type(o_a).__qualname__}")
            name = dtype_name(out_dtype, source)
            out, out_view = empty(o_b, shape, name)
        if out_lse is None and return_lse:
            out_lse, lse_view = empty(o_b, shape[:2], "float32")
    if stream is None:
        stream = default_stream(o_b)
    _C.merge(out_view, lse_view, o_a, lse_a, o_b, lse_b, flags, a_tok, stream)
    if family(out) == "jax" and out is not out_view:
        _C.stream_synchronize(_C.pointer_device(out.unsafe_buffer_pointer()), stream or 0)
    return out, out_lse
