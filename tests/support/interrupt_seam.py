"""A trace function that lands a KeyboardInterrupt at one chosen point where CPython may raise an asynchronous
exception: for tests that walk an interrupt over every such point of a piece of code, one round per point."""

import dis

# The instructions after which CPython runs pending signal handlers (and raises what PyThreadState_SetAsyncExc
# set): a call (of C code: after it returned), a backward jump; and a function's start. 3.10-3.13 names; a name a
# release lacks just gives no point.
CHECKED_AFTER = {dis.opmap[name] for name in ("CALL", "CALL_KW", "CALL_FUNCTION", "CALL_FUNCTION_KW",
                                              "CALL_FUNCTION_EX", "CALL_METHOD", "JUMP_BACKWARD", "JUMP_ABSOLUTE")
                 if name in dis.opmap}


class Seam:
    """Raises KeyboardInterrupt at the `at`-th point (a function's start, the instruction after a call or a backward
    jump) among those `admits(frame, event)` counts (all, when None), in every frame it sees; `fired` says where.
    Install with sys.settrace; a trace function that raises is switched off: one interrupt per trace."""

    def __init__(self, at: int, admits=None):
        self.at, self.admits, self.seen, self.fired = at, admits, 0, None
        self._last = {}  # frame -> the opcode it ran last

    def __call__(self, frame, event, arg):
        frame.f_trace_opcodes = True
        return self.local(frame, event, arg)

    def local(self, frame, event, arg):
        if event == "opcode":
            last, self._last[frame] = self._last.get(frame), frame.f_code.co_code[frame.f_lasti]
            point = last in CHECKED_AFTER
        else:
            point = event == "call"
        if not point or (self.admits is not None and not self.admits(frame, event)):
            return self.local
        if self.seen == self.at:
            self.seen += 1
            self.fired = (frame.f_code.co_name, event, frame.f_lineno)
            self._last.clear()
            raise KeyboardInterrupt
        self.seen += 1
        return self.local
