# The compiled module's interface (_async_compiled.c); otel_kvtransfer/engines/mooncake/compiled.py says when it is
# used. stubtest (scripts/typecheck.sh) holds this file to the built module.
from typing import Any, Callable, Dict, Hashable, List, final

# The positions the C part reads and builds, by their Python names (compiled.layout() must be the same).
LAYOUT: Dict[str, int]

@final
class Submission:
    __wrapped__: Callable[..., Any]
    def __init__(self, original: Callable[..., Any], fallback: Callable[..., Any], refused: Callable[..., None],
                 report: Callable[[str], None], recorder: Any, context: Callable[[], Any], entered: List[int],
                 last: List[Any], waiting: Dict[Hashable, Any], reused: Callable[[Hashable, Any, Any], None],
                 suppress: str, suppress_plain: str, base: int, at: int, batch: bool) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __get__(self, instance: Any, owner: Any = None, /) -> Callable[..., Any]: ...

@final
class BatchWait:
    __wrapped__: Callable[..., Any]
    def __init__(self, original: Callable[..., Any], completed: Callable[..., None], ended: Callable[..., None],
                 reclaim: Callable[..., None], report: Callable[[str], None], recorder: Any,
                 waiting: Dict[Hashable, Any],
                 seen: Dict[Hashable, int], raw_async: int, base: int) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __get__(self, instance: Any, owner: Any = None, /) -> Callable[..., Any]: ...
