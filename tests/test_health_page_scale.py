"""The health page of a swarm of a hundred nodes stays readable: nodes grouped by span under one
summary line each, their rows opened on demand; a small swarm keeps its one table."""

from __future__ import annotations

import re

from swarm.health.render import render_page
from swarm.health.snapshot import DhtStatus, Known, Snapshot, build_model_view
from swarm.records import ModelRecord, NodeRecord
from tests.helpers.records import node_record

LAYERS = 30
NOW = 1001.0


def record(i: int, span: tuple[int, int], fingerprint: str = "fp") -> NodeRecord:
    return node_record(
        f"peer{i:03d}", *span, addr=f"10.0.{i // 250}.{i % 250}:7000", fingerprint=fingerprint,
        version="0", num_layers=LAYERS, free_cache_tokens=4096, throughput=20.0, sessions=i % 3,
        updated=1000.0,
    )  # fmt: skip


def page(records: list[NodeRecord]) -> str:
    known = [Known(r, NOW + 30) for r in records]
    model = build_model_view(ModelRecord("m", LAYERS, "fp"), known, {}, NOW)
    return render_page(Snapshot(taken_at=NOW, dht=DhtStatus("ok", NOW, 0.01), models=(model,)), 10)


SPANS = [(s, s + 3) for s in range(0, LAYERS, 3)]  # 10 spans


def test_a_hundred_nodes_show_as_one_closed_group_per_span_with_every_row_inside():
    html = page([record(i, SPANS[i % 10]) for i in range(100)])
    groups = re.findall(r'<details class="group" data-span="(\d+:\d+)"( open)?>', html)
    assert [span for span, _ in groups] == [f"{a}:{b}" for a, b in SPANS]
    assert not any(is_open for _, is_open in groups)
    assert len(re.findall(r'<tr[^>]*data-peer="peer\d+"', html)) == 100
    assert "blocks 0:3</span> · 10 nodes (10 usable) · 200 tok/s" in html


def test_a_group_holding_a_node_that_is_not_usable_is_open():
    records = [record(i, SPANS[i % 10]) for i in range(99)]
    records.append(record(99, SPANS[9], fingerprint="other"))
    html = page(records)
    opened = re.findall(r'<details class="group" data-span="(\d+:\d+)" open>', html)
    assert opened == ["27:30"]


def test_a_small_swarm_is_one_table_without_groups():
    html = page([record(i, SPANS[i % 3]) for i in range(6)])
    assert '<details class="group"' not in html and html.count("<table>") == 1
