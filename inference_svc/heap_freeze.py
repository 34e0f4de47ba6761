"""What a server's load built, moved out of the garbage collector's full collections while it serves.

Why: a loaded server holds a few hundred thousand long-lived objects (torch and its compiled graphs' modules, the
model, the tokenizer, the app). Request traffic allocates container objects fast enough that CPython collects its
oldest generation every second or two under load, and each of those collections walks every one of them: about
175 ms on the 82M benchmark model, during which the event loop stops and so does the engine thread between kernels
(its Python needs the GIL): a stall in every stream and in the time to first token of every request waiting
(docs/benchmarks.md §32). `gc.freeze()` is CPython's answer: frozen objects are never scanned again.

Contract:
- `freeze_load()` runs one full collection (the load's own garbage goes first, not into the frozen set), then
  freezes what survived; it returns how many objects are frozen in this process now. A server calls it once
  loaded and warmed up, before it says SERVING (the one pause, spent where no request waits).
- `thaw()` unfreezes them when that server stops, so a process that goes on (an embedding application, a test
  session, a Ray replica restarted in place) collects them again: an object frozen stays alive only if it is in
  a reference cycle, until the next collection after `thaw()`. With two servers in one process, the first to stop
  thaws both: the other serves on with ordinary collections, nothing is lost.
- The collector's thresholds and its enabled state are left as they are: young objects (a request's own) are
  collected as before.
"""

from __future__ import annotations

import gc


def freeze_load() -> int:
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    gc.unfreeze()
