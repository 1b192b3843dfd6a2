"""The quantized head's rescoring rows (swarm.model.kept_rows): dequantized once, kept within a
byte budget, always the table's own rows."""

from __future__ import annotations

import pytest
import torch

from swarm.model.kept_rows import KeptRows
from swarm.model.source import open_model


@pytest.fixture(scope="module")
def table():
    return open_model(None).head_raw()["embed"]  # the default model's Q8_0 table


def test_kept_rows_are_the_table_s_rows_in_the_order_asked(table):
    kept = KeptRows(table)
    ids = [7, 300, 7, 49151, 0]
    kept.rows([300, 5])
    assert torch.equal(kept.rows(ids), table.rows(ids))


def test_a_row_asked_again_is_not_dequantized_again(table):
    kept = KeptRows(table)
    kept.rows([1, 2, 3])
    kept.rows([3, 2, 1, 4])
    assert kept.dequantized == 4


def test_past_the_budget_the_least_recently_used_row_goes_first(table):
    width = table.shape[1]
    kept = KeptRows(table, budget=3 * 4 * width)
    kept.rows([10, 11, 12])
    kept.rows([10])  # 11 is now the least recently used
    kept.rows([13])
    assert kept.dequantized == 4
    kept.rows([10, 12, 13])
    assert kept.dequantized == 4  # all still kept
    assert torch.equal(kept.rows([11]), table.rows([11]))  # dropped: dequantized again
    assert kept.dequantized == 5


def test_more_rows_than_the_budget_holds_are_served_without_keeping_them(table):
    width = table.shape[1]
    kept = KeptRows(table, budget=2 * 4 * width)
    ids = [20, 21, 22, 20]
    assert torch.equal(kept.rows(ids), table.rows(ids))
    assert torch.equal(kept.rows([20, 21]), table.rows([20, 21]))
