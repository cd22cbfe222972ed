"""The runtime on the real Gemma 3 270M GGUF (Q4_K_M: Q8_0, Q5_0, Q4_K, Q6_K and F32 tensors).

Parity against independent implementations (tests/refdata/gemma3_reference.json: HF
transformers and llama.cpp on the same file), SentencePiece tokenization equal to llama.cpp's,
and the bit-exact invariants with sliding-window layers whose rings keep only their window:
cache-on = cache-off, chunked = whole, split ranges = one process, longest-prefix replay =
cold prefill. Prompts stay short except one that passes the 512-key window, so the whole file
costs a few seconds of model time.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest

from amplituhedron_rs.runtime import Model, SessionOptions
from amplituhedron_rs.runtime.gguf_file import read_model_file
from amplituhedron_rs.runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.model

CONFIDENT = 0.3  # reference top-2 margin above which both implementations must agree


@pytest.fixture(scope="module")
def gemma_prompts(gemma_reference: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in gemma_reference["prompts"]}


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_path: Path) -> Tokenizer:
    return Tokenizer(read_model_file(gemma_path))


# --- tokenizer and template ------------------------------------------------------------


def test_the_file_is_described_as_llama_cpp_reads_it(gemma_path: Path) -> None:
    c = read_model_file(gemma_path).config
    assert (c["arch"], c["n_layers"], c["hidden"], c["n_heads"], c["n_kv_heads"]) == (
        "gemma3",
        18,
        640,
        4,
        1,
    )
    # head width 256 although hidden / heads = 160; attention scaled by 1/sqrt(256).
    assert (c["head_dim"], c["attn_scale"]) == (256, 1 / 16)
    assert (c["sliding_window"], c["rope_base_local"], c["rope_base"]) == (512, 1e4, 1e6)
    assert [i for i, local in enumerate(c["local_layers"]) if not local] == [5, 11, 17]


def test_tokenization_equals_llama_cpp(
    gemma_tokenizer: Tokenizer, gemma_reference: dict[str, Any]
) -> None:
    for case in gemma_reference["tokenization"]:
        ids = gemma_tokenizer.encode(case["text"])
        assert ids == case["llamacpp_ids"], case["name"]
        assert ids[0] == gemma_tokenizer.bos_id, case["name"]
        assert gemma_tokenizer.decode(ids[1:]) == case["text"], case["name"]


def test_prompt_ids_equal_llama_cpp(
    gemma_tokenizer: Tokenizer, gemma_prompts: dict[str, dict[str, Any]]
) -> None:
    for name, p in gemma_prompts.items():
        assert gemma_tokenizer.encode(p["text"]) == p["token_ids"], name


def test_chat_ids_use_gemma_turns(
    gemma_tokenizer: Tokenizer, gemma_prompts: dict[str, dict[str, Any]]
) -> None:
    # The file has no template: Gemma's own turn format is used, BOS added by the tokenizer.
    ids = gemma_tokenizer.chat_ids(None, "Name three planets of the solar system.")
    assert ids == gemma_prompts["chat"]["token_ids"]
    with_system = gemma_tokenizer.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    expected = "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert with_system == expected


# --- parity with transformers and llama.cpp ---------------------------------------------


def test_argmax_agrees_at_every_confident_position(
    gemma: Model, gemma_prompts: dict[str, dict[str, Any]]
) -> None:
    checked = 0
    for name in ("sentence", "rust", "chat", "multilingual"):
        p = gemma_prompts[name]
        ours = gemma.logits_all(p["token_ids"]).argmax(axis=1)
        for pos, (ref, margin) in enumerate(
            zip(p["hf_argmax_per_position"], p["hf_top2_margin_per_position"], strict=True)
        ):
            if margin >= CONFIDENT:
                assert ours[pos] == ref, f"{name} position {pos}: {ours[pos]} vs {ref}"
                checked += 1
    assert checked > 20


def test_last_logits_within_the_reference_to_reference_distance(
    gemma: Model,
    gemma_prompts: dict[str, dict[str, Any]],
    gemma_hf_last_logits: dict[str, np.ndarray[Any, np.dtype[np.float32]]],
) -> None:
    for name, p in gemma_prompts.items():
        ours = gemma.logits(p["token_ids"]).astype(np.float64)
        diff = np.abs(ours - gemma_hf_last_logits[name])
        between_references = p["last_logits_absdiff_hf_vs_llamacpp"]["max"]
        assert diff.max() <= between_references, (
            f"{name}: max |Δ| vs transformers {diff.max():.3f} > {between_references:.3f} "
            f"(transformers vs llama.cpp)"
        )
        assert int(ours.argmax()) == p["hf_top5_ids"][0], name


@pytest.mark.parametrize("name", ["sentence", "chat", "long"])
def test_greedy_continuation_matches_until_the_first_near_tie(
    gemma: Model, gemma_prompts: dict[str, dict[str, Any]], name: str
) -> None:
    p = gemma_prompts[name]
    margins = p["hf_greedy16_top2_margins"]
    clear = next((i for i, m in enumerate(margins) if m < CONFIDENT), len(margins))
    # Tokens after the first near-tie are not compared, so they are not generated either.
    g = gemma.generate(p["token_ids"], max(clear, 1), use_cache=False, stop_at_eos=False)
    assert g.output_ids[:clear] == p["hf_greedy16_ids"][:clear]


# --- bit-exact invariants with sliding-window layers ------------------------------------


def test_long_prompt_passes_the_sliding_window(gemma_prompts: dict[str, dict[str, Any]]) -> None:
    assert gemma_prompts["long"]["n_tokens"] > 512 + 64


def test_cache_on_equals_cache_off(gemma: Model, gemma_prompts: dict[str, dict[str, Any]]) -> None:
    ids = gemma_prompts["chat"]["token_ids"]
    gemma.clear_cache()
    cold = gemma.generate(ids, 8, use_cache=False, stop_at_eos=False)
    first = gemma.generate(ids, 8, stop_at_eos=False)
    warm = gemma.generate(ids, 8, stop_at_eos=False)
    assert not first.cache_hit and warm.cache_hit
    assert cold.output_ids == first.output_ids == warm.output_ids
    session = gemma.new_session(0, gemma.n_layers)
    replay = gemma.pipeline.amplituhedron_replay(session, ids)
    assert replay is not None and replay.status == "hit" and replay.logits is not None
    np.testing.assert_array_equal(replay.logits, gemma.logits(ids))


@pytest.mark.parametrize("chunk", [1, 100])
def test_chunked_prefill_equals_whole_prompt_past_the_window(
    gemma: Model, gemma_prompts: dict[str, dict[str, Any]], chunk: int
) -> None:
    ids = gemma_prompts["long"]["token_ids"]
    if chunk == 1:
        ids = ids[:40]  # one row at a time costs a full weight pass per token
    whole = gemma.new_session(0, gemma.n_layers)
    chunked = gemma.new_session(0, gemma.n_layers, SessionOptions(max_chunk=chunk))
    _, a = whole.forward_tokens(ids, logits="last")
    _, b = chunked.forward_tokens(ids, logits="last")
    assert a is not None and b is not None
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cuts", [[0, 5, 6, 18], [0, 9, 18]])
def test_split_ranges_equal_one_process(
    gemma: Model, gemma_prompts: dict[str, dict[str, Any]], cuts: list[int]
) -> None:
    ids = gemma_prompts["rust"]["token_ids"]
    hidden: np.ndarray[Any, np.dtype[np.float32]] | None = None
    logits = None
    for lo, hi in itertools.pairwise(cuts):
        s = gemma.new_session(lo, hi)
        want: Literal["last", "none"] = "last" if hi == gemma.n_layers else "none"
        if lo == 0:
            hidden, logits = s.forward_tokens(ids, logits=want)
        else:
            assert hidden is not None
            hidden, logits = s.forward_hidden(hidden, logits=want)
    assert logits is not None
    np.testing.assert_array_equal(logits[-1], gemma.logits(ids))


def test_sliding_layers_keep_only_their_window(gemma: Model) -> None:
    # A session's KV is bounded: the 15 local layers hold the window (plus one span of
    # slack), not the 4096 slots of the 3 global layers.
    s = gemma.new_session(0, gemma.n_layers)
    assert s.kv_slots == [768 if local else 4096 for local in gemma.file.config["local_layers"]]


@pytest.mark.mesh
def test_a_two_station_mesh_equals_one_process(
    gemma: Model, gemma_path: Path, gemma_prompts: dict[str, dict[str, Any]]
) -> None:
    import asyncio

    from amplituhedron_rs.mesh.coordinator import Coordinator
    from amplituhedron_rs.mesh.launcher import LocalMesh

    ids = gemma_prompts["chat"]["token_ids"]
    single = gemma.generate(ids, 8, use_cache=False, stop_at_eos=False)

    async def generate(spec: Any, use_cache: bool) -> tuple[list[int], bool]:
        async with Coordinator(spec, token="gemma-mesh") as c:
            g = await c.generate(ids, 8, use_cache=use_cache)
            return list(g.output_ids), g.cache_hit

    # Layers 0..9 and 9..18: each station holds sliding and global layers.
    with LocalMesh(2, model_path=str(gemma_path), token="gemma-mesh") as spec:
        cold, _ = asyncio.run(generate(spec, False))
        first, first_hit = asyncio.run(generate(spec, True))
        warm, warm_hit = asyncio.run(generate(spec, True))
    assert cold == first == warm == single.output_ids
    assert not first_hit and warm_hit
