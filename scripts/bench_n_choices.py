"""What ``n`` choices cost: ``n`` sampled choices of one cold prompt (the first computes it,
the others follow and replay it from the volume cache) against the floor, one cold prefill
plus ``n`` decode streams of a warm prompt, measured in the same run (in process, SmolLM2).

    python scripts/bench_n_choices.py [--n 8] [--prompt-tokens 512] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import time
import uuid

import amplituhedron_rs as ar
from amplituhedron_rs import _core


def run(
    engine: _core.Engine, prompt: list[int], new: int, seeds: list[int], salt: str, follow: bool
) -> float:
    """Seconds until every request ended; the first leads the others when ``follow``."""
    start = time.perf_counter()
    ids: list[int] = []
    for seed in seeds:
        leader = ids[0] if follow and ids else None
        ids.append(
            engine.submit(
                prompt, new, greedy=False, temperature=0.8, seed=seed, salt=salt, follows=leader
            )
        )
    left = set(ids)
    while left:
        for ev in engine.step():
            if ev.kind == "finished":
                assert ev.reason in ("length", "stop"), ev.error
                left.discard(ev.seq)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    model = ar.load_model(batch=ar.BatchOptions(max_running=max(8, a.n)))
    engine = model.engine
    text = " ".join(f"item {i} is blue," for i in range(a.prompt_tokens))
    prompt = model.tokenize(text)[: a.prompt_tokens]
    seeds = list(range(a.n))
    ratios = []
    for r in range(a.repeats):
        cold = [uuid.uuid4().hex for _ in range(3)]
        n_choices = run(engine, prompt, a.new_tokens, seeds, cold[0], follow=True)
        one_choice = run(engine, prompt, a.new_tokens, seeds[:1], cold[1], follow=False)
        prefill = run(engine, prompt, 1, seeds[:1], cold[2], follow=False)
        # The same prompt, now cached under cold[2]: n decode streams alone.
        streams = run(engine, prompt, a.new_tokens, seeds, cold[2], follow=False)
        floor = prefill + streams
        ratios.append(n_choices / floor)
        print(
            f"run {r}: n={a.n} choices {n_choices:.3f} s; one choice {one_choice:.3f} s; "
            f"one prefill {prefill:.3f} s + {a.n} warm streams {streams:.3f} s = {floor:.3f} s; "
            f"ratio {n_choices / floor:.2f}x"
        )
    median = sorted(ratios)[len(ratios) // 2]
    print(f"median ratio n-choices / (prefill + {a.n} streams): {median:.2f}x")


if __name__ == "__main__":
    main()
