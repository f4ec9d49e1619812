"""Layer-by-layer transfer: each layer's KV moves while the forward computes other layers.

`compute_window` is the per-layer window every framework drives; `vllm_window` and
`ascend_window` install it into vLLM's and vLLM-Ascend's attention paths.
"""
