"""Python's cyclic garbage collector around the imports of torch, DTensor, DCP and partrain.

Those imports create about 300,000 objects that live as long as the process. With the collector
on, every allocation-triggered full collection during the import walks all of the objects made so
far (the rank server's imports: 3.2-4.1 s of CPU with it on, 2.6-3.6 s off), and later a full
collection (end_distributed's, before the process group is destroyed) walks them again. In a
rank forked from the rank server (forked.py) that walk also writes to every object's header and
so copies each page it shares with the server.

`imports_without_gc()` turns the collector off for the block of imports and then moves everything
alive into the permanent generation (gc.freeze), which no collection walks; the collector is on
again after it. The rank server turns it off as its first import (rank_server.py) and each rank
forked from it calls `after_fork()` first thing. What this costs: cycles made during the imports
are never freed (module-level structures, nothing that grows), and gc.get_objects() no longer
lists the frozen objects (observe/memory.py counts tensors made after the imports: the model's,
the batches', the optimizer's).
"""

import gc
from contextlib import contextmanager


@contextmanager
def imports_without_gc():
    """The collector off for the block; what is alive at its end frozen, the collector back on."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()


def after_fork() -> None:
    """In a rank forked from the rank server (which imports with the collector off): freeze what
    came from the server and turn the collector on for the rank's own objects."""
    gc.freeze()
    gc.enable()
