"""The comparison's markdown tables, from hand-made rows (no training)."""

from __future__ import annotations

import dataclasses

import pytest

from jax_qtrain.train.compare import (
    ComparisonRow,
    comparison_rows,
    evaluation_table,
    markdown_table,
    seed_gap_table,
)


def _row(recipe: str, evaluations: tuple[tuple[int, float], ...]) -> ComparisonRow:
    final = evaluations[-1][1]
    best_step, best = min(evaluations, key=lambda e: e[1])
    return ComparisonRow(
        recipe=recipe,
        final_train_loss=0.5,
        final_val_loss=final,
        best_val_loss=best,
        best_val_step=best_step,
        val_gap_vs_bf16=None,
        step_time_ms=26.0,
        tokens_per_s=1.2e6,
        compile_time_s=30.0,
        epochs=3.25,
        evaluations=evaluations,
    )


# The h200 preset's 1000-step runs, seed 0 (docs/benchmarks.md, stop 29).
BF16 = _row("bf16", ((250, 1.3621), (500, 0.9954), (750, 0.9257), (1000, 0.9226)))
NVFP4 = _row("nvfp4", ((250, 1.3948), (500, 0.9896), (750, 0.9117), (1000, 0.8936)))


def test_evaluation_table_gives_the_gap_at_each_step():
    table = evaluation_table([BF16, NVFP4])
    assert "| step | bf16 | nvfp4 |" in table
    assert "| 250 | 1.3621 | 1.3948 (+2.40%) |" in table
    assert "| 500 | 0.9954 | 0.9896 (-0.58%) |" in table
    assert "| 1000 | 0.9226 | 0.8936 (-3.14%) |" in table


def test_evaluation_table_marks_missing_steps_and_runs_without_bf16():
    # A run cut short has no later evaluations; without bf16 there is no gap to give.
    short = _row("fp8", ((250, 1.35), (500, 0.99)))
    table = evaluation_table([BF16, short])
    assert "| 750 | 0.9257 | — |" in table and "| 500 | 0.9954 | 0.9900 (-0.54%) |" in table
    alone = evaluation_table([NVFP4])
    assert "| 250 | 1.3948 |" in alone and "%" not in alone


def test_markdown_table_has_the_best_loss_the_epochs_and_the_evaluations():
    table = markdown_table([BF16, NVFP4])
    assert "| bf16 | 0.5000 | 0.9226 | 0.9226 (1000) | — |" in table
    assert "Each run trained 3.25 epochs of the training split." in table
    assert table.endswith(evaluation_table([BF16, NVFP4]))
    # Rows without evaluations (hand-made, or before they were recorded): the first table only.
    bare = [dataclasses.replace(BF16, evaluations=())]
    assert "Validation loss at each evaluation" not in markdown_table(bare)


@pytest.mark.parametrize("table", [markdown_table, evaluation_table, seed_gap_table])
def test_tables_of_no_rows_are_refused(table):
    with pytest.raises(ValueError, match="rows: a table needs at least one recipe's row"):
        table([])


def test_evaluations_of_a_recipe_without_a_summary_are_refused():
    with pytest.raises(ValueError, match=r"evaluations: recipes without a run summary: \['fp8'\]"):
        comparison_rows([], {"fp8": ((10, 2.0),)})
