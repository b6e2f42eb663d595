"""kvsplice.server.launch: the start-up heap freeze (the rest of launch is exercised by the server
and CLI tests that start it)."""

import gc

from kvsplice.server.launch import freeze_startup_heap


def test_the_start_up_heap_leaves_the_collected_generations_and_new_objects_stay_collectable():
    held = [[index] for index in range(1000)]   # tracked containers alive at "start-up"
    try:
        frozen = freeze_startup_heap()
        assert frozen >= len(held)   # (the count can fall after: refcounting still frees frozen objects)
        in_generations = {id(obj) for obj in gc.get_objects()}
        assert not any(id(obj) in in_generations for obj in held)
        later = [[]]
        later[0].append(later)                     # a cycle made after the freeze
        assert id(later) in {id(obj) for obj in gc.get_objects()}
        del later
        assert gc.collect() >= 2
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
