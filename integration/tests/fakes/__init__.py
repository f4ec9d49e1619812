"""Faithful stand-ins for packages that cannot run here (vllm-ascend, torch_npu).

They mirror the real module paths, class and method names and call order of the code they
replace, and are put on `sys.path` only when the real package is absent.
"""
