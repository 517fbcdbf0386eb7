"""Drop-in layers that keep other libraries' signatures and conventions exactly.  Each passes its
argument names down to the native functions (their `_names`), so that every error names the
caller's argument (vLLM's prefix_output, FlashInfer's v_a)."""
