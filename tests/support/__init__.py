"""What the tests on real engines share, one module per concern.

- netns: a process in a private network namespace with only loopback up (what binds all interfaces runs there);
- instrumented_app: a test's own app under `opentelemetry-instrument`, inside such a namespace, and the spans it
  wrote;
- logs: the package's own WARNING lines, captured while a block runs;
- metrics: what the instrumentation counted, read back from an in-memory metric reader;
- nixl_agents: NIXL agents kept out of the pytest process, and an initiator connected to a loopback receiver;
- otlp: our span encoder installed in the OTLP exporters, and OTLP/HTTP and OTLP/gRPC receivers on 127.0.0.1;
- sglang_runs: the requests sent to a real SGLang deployment and the spans its servers wrote.
- waiting: bounded waits on a condition itself (never a fixed sleep standing in for "until"), or on a process's
  exit.

The SGLang and vLLM deployments themselves live in tests/sglang_serving/ and tests/vllm_serving/.
"""
