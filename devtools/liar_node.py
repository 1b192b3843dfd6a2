"""A node that lies in its records, for tests of what a lie costs the swarm: it serves its
--layers as any node does, but announces LIE_END as the end of its span and LIE_THROUGHPUT
tokens/s, spends LIE_SLOW_S more on every pass and scales what it computes by LIE_SCALE; with
SLOW_LOAD_S it stays joining that much longer, as a node loading a big span from a slow disk
(environment variables). Run as a script: `python devtools/liar_node.py --layers 0:3 ...`,
or `start_liar(...)` below."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time

from swarm.model.blocks import Span
from swarm.node import announce
from swarm.node.__main__ import main

honest_record = announce.Announcer.record


def lying_record(self, *args, **kwargs):
    record = honest_record(self, *args, **kwargs)
    end = int(os.environ.get("LIE_END", record.end))
    throughput = float(os.environ.get("LIE_THROUGHPUT", record.throughput))
    return dataclasses.replace(record, end=end, throughput=throughput)


def lying(method):
    @functools.wraps(method)
    def lie(*args, **kwargs):
        time.sleep(float(os.environ.get("LIE_SLOW_S", 0)))
        return method(*args, **kwargs) * float(os.environ.get("LIE_SCALE", 1))

    return lie


def start_liar(layers, peers, model: str, extra, **lies):
    """Start a liar node like devtools.launch.start_node; `lies`: LIE_END=6, LIE_SCALE=1.5..."""
    from devtools.launch import start_node

    env = {name: str(value) for name, value in lies.items()}
    return start_node(layers, peers, model=model, extra=extra, program=(__file__,), env=env)


def slow_load(load):
    @functools.wraps(load)
    def slow(*args, **kwargs):
        time.sleep(float(os.environ.get("SLOW_LOAD_S", 0)))
        return load(*args, **kwargs)

    return slow


if __name__ == "__main__":
    announce.Announcer.record = lying_record
    Span.forward, Span.decode = lying(Span.forward), lying(Span.decode)
    Span.load = classmethod(slow_load(Span.load.__func__))
    sys.exit(main())
