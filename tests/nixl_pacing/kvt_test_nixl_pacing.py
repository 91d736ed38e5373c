"""TEST-ONLY, for this two-core machine: every NIXL agent's progress thread pauses 100 us between idle polls.

nixl's Python API (1.5) builds each agent's C++ configuration with `pthrDelay = 0`, so the progress thread it
starts (on by default, and sglang and vLLM keep it on) never sleeps: one full core per agent, busy or idle
(one idle agent here: 0.98 CPU-s per second; with a 100 us pause, 0.02). On a GPU host that is one core of many;
here two or three such agents take both cores from the servers (a vLLM NIXL pair's first request took 23 s
instead of 4 s, and a normal request's KV lease could run out). The configuration type is replaced, in nixl's
API module only, by a subclass that turns the 0 into 100 us; the thread still progresses transfers in the
background, and what moves, and when the engines see it done, is unchanged. `KVT_TEST_NIXL_BUSY_POLL=1` keeps
NIXL's own setting.

Loaded by sglang's and vLLM's own plugin loaders (the dist-info folder beside this file declares both groups) in
every process they start, when the tests put this folder on PYTHONPATH; the tests that make agents themselves
(tests/support/nixl_agents.py, tests/vllm_versions/payload_paths.py) call `activate()` before NIXL is imported.
"""

import os
import sys

PAUSE_US = 100
_state = {"paced": False}


class _Api:
    """nixl's binding module as nixl's API module sees it, with the configuration type replaced."""

    def __init__(self, binding, config_type):
        self._binding, self.nixlAgentConfig = binding, config_type

    def __getattr__(self, name):
        return getattr(self._binding, name)


def _pace(_nixl) -> None:
    api = sys.modules.get("nixl._api")
    if api is None or _state["paced"]:
        return
    binding = api.nixlBind

    class PacedConfig(binding.nixlAgentConfig):
        def __setattr__(self, name, value):
            super().__setattr__(name, PAUSE_US if name == "pthrDelay" and value == 0 else value)

    api.nixlBind = _Api(binding, PacedConfig)
    _state["paced"] = True


def activate() -> None:
    if os.environ.get("KVT_TEST_NIXL_BUSY_POLL") == "1":
        return
    if "nixl" in sys.modules:
        _pace(sys.modules["nixl"])
    else:
        import wrapt

        wrapt.register_post_import_hook(_pace, "nixl")
