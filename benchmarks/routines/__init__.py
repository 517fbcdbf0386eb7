"""The routines of benchmarks/run.py, one module each: its name, the module, and what it times."""

ROUTINES = {
    "sinks": ("sinks", "merge_states with and without a sink"),
    "bases": ("bases", "mixed LSE bases against one base and against converting first"),
    "group_fp8": ("group_fp8", "per-group FP8 outputs against bf16 and against bf16 then a quantization"),
    "block_scaled": ("block_scaled", "MXFP8 and NVFP4 outputs against bf16 then the format's compiled quantizer"),
    "share": ("share", "merge_share against a two-way merge of the same rows and the floor"),
    "layouts": ("layouts", "merge_states on an exchange's layouts and packed records against the stacked layout"),
    "state_forms": ("state_forms", "merge_states of (max, sum) statistics and of empty shards (valid) against LSEs"),
    "exchange": ("exchange", "the exchange fused with the merge, ranks on one GPU, against the floor and a gather"),
    "cp_step": ("cp_step", "context parallelism across W GPUs: each form's exchange, merge and both, checked"),
    "live_tokens": ("live_tokens", "a call at a capacity reading the live count on the device, against a sized one"),
    "pdl_chain": ("pdl_chain", "a producer kernel then the merge, graph-captured, with and without PDL"),
    "plain_pairs": ("plain_pairs", "the plain two-way kernels against the general one, per dtype pair"),
    "vs_seed": ("vs_seed", "the two-way merge against vLLM's kernel this project started from"),
    "vs_flashinfer": ("vs_flashinfer", "the merge family against FlashInfer's CUDA cascade kernels"),
    "bench": ("package", "the sweep of `python -m attnmerge bench` (its options follow)"),
    "family": ("package", "the N-way family of `python -m attnmerge bench --family`"),
}
