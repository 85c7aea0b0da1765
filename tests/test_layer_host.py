"""The lean layer's per-call path (mxdb.kernels.lean) on fake tensors and launchers: no torch."""

from __future__ import annotations

from typing import Any

from mxdb.kernels.lean import OUT, TOPK_IDS, TOPK_WEIGHTS, LaunchPlan, LeanLayer, X


class T:
    def __init__(self, m: int, name: str) -> None:
        self.shape = (m, 4)
        self.name = name


def test_plan_binds_inputs_and_stream_per_call() -> None:
    seen: list[tuple[Any, ...]] = []

    def launch(*args: Any) -> None:
        seen.append(args)

    own_out = T(2, "own")
    streams = iter(range(100))
    plan = LaunchPlan(
        [
            (launch, [9, None, None, None], ((1, X), (2, TOPK_IDS)), 3),
            (launch, [None, 7], ((0, TOPK_WEIGHTS),), -1),
            (launch, [None, None], ((0, OUT),), 1),
        ],
        own_out,
        stream_fn=lambda: next(streams),
    )
    x, tw, ids = T(2, "x"), T(2, "tw"), T(2, "ids")
    assert plan(x, tw, ids) is own_out
    assert seen[0] == (9, x, ids, 0)
    assert seen[1] == (tw, 7)
    assert seen[2] == (own_out, 0)
    mine = T(2, "mine")
    x2 = T(2, "x2")
    assert plan(x2, tw, ids, mine) is mine
    assert seen[3] == (9, x2, ids, 1) and seen[5] == (mine, 1)
    assert plan.launches == 3


def test_layer_asks_config_once_per_token_count_and_reuses_workspaces() -> None:
    asked: list[int] = []
    built: list[tuple[int, Any]] = []

    def config_for(m: int) -> Any:
        asked.append(m)
        return None if m == 3 else f"cfg{m}"

    def build(m: int, cfg: Any, x: Any, tw: Any, ids: Any) -> Any:
        built.append((m, cfg))
        return lambda x, tw, ids, out: (m, cfg, out)

    layer = LeanLayer(build, config_for, default_config=lambda m: f"default{m}")
    for _ in range(3):
        for m in (1, 3, 1, 16):
            res = layer(T(m, "x"), T(m, "tw"), T(m, "ids"))
            assert res[0] == m
    assert asked == [1, 3, 16]
    assert built == [(1, "cfg1"), (3, "default3"), (16, "cfg16")]
    assert layer.config_at(3) == "default3" and asked == [1, 3, 16]
    assert layer.workspace(2) is None
