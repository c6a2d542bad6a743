"""One pass over a mapping handed to several readers (cisjax.rollout.fanout): every reader gets every item, in order;
a reader that stops early holds nobody up."""

import threading

from cisjax.rollout.fanout import Fanout


class _Once(dict):
    """A mapping whose items can be read once only (as a fleet's streamed tensors)."""

    reads = 0

    def items(self):
        self.reads += 1
        assert self.reads == 1, "read twice"
        return super().items()


def test_every_reader_gets_every_item_and_a_stopped_one_is_skipped():
    source = _Once({f"t{i}": i for i in range(50)})
    fan = Fanout(source, ["a", "b", "c"], depth=2)
    got = {"a": [], "b": [], "c": []}

    def read(key, limit=None):
        try:
            for item in fan.view(key).items():
                got[key].append(item)
                if len(got[key]) == limit:
                    return  # a reader failing part-way
        finally:
            fan.stop(key)

    readers = [threading.Thread(target=read, args=("a",)), threading.Thread(target=read, args=("b",))]
    readers.append(threading.Thread(target=read, args=("c", 3)))
    for t in readers:
        t.start()
    producer = threading.Thread(target=fan.run)
    producer.start()
    producer.join(timeout=30)
    for t in readers:
        t.join(timeout=30)
    assert not producer.is_alive() and not any(t.is_alive() for t in readers)
    assert got["a"] == got["b"] == [(f"t{i}", i) for i in range(50)]
    assert got["c"] == got["a"][:3]
