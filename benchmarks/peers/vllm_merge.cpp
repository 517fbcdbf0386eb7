// Exposes vLLM's merge_attn_states host function (csrc/attention/merge_attn_states.cu of the vllm
// source distribution, fetched by benchmarks/peers/fetch.py: the kernel this project started from)
// to Python as a PyTorch extension, so that the vs_seed routine can time it.  The declaration is
// vLLM's (csrc/ops.h of the same release); benchmarks/routines/peers.py compiles the two files
// together into the ignored benchmarks/peers/build/, never committed.
#include <optional>

#include <torch/extension.h>

void merge_attn_states(torch::Tensor& output, std::optional<torch::Tensor> output_lse,
                       const torch::Tensor& prefix_output, const torch::Tensor& prefix_lse,
                       const torch::Tensor& suffix_output, const torch::Tensor& suffix_lse);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("merge_attn_states", &merge_attn_states,
        "output [tokens, heads, head_size] (and output_lse [heads, tokens] unless None) = the merge of "
        "the prefix and suffix states, natural-log LSEs [heads, tokens]",
        pybind11::arg("output"), pybind11::arg("output_lse"), pybind11::arg("prefix_output"),
        pybind11::arg("prefix_lse"), pybind11::arg("suffix_output"), pybind11::arg("suffix_lse"));
}
