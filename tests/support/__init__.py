"""What the tests share, one module per concern: docs/testing.md ("Test layout") says what each holds.

The SGLang and vLLM deployments themselves live in tests/sglang_serving/ and tests/vllm_serving/.
"""
