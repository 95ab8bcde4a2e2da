"""Tokenizer (tokenizers BPE built in-test), chat templates and assistant-only loss masks."""
import numpy as np
import pytest

from mmjax.errors import UserError
from mmjax.data.layout import AssemblyLayout
from mmjax.data.assemble import assemble
from mmjax.data.chat import ChatError, ChatFormat
from mmjax.data.example_data import write_tokenizer
from mmjax.data.sample import Sample, Segment
from mmjax.data.tokenizer import MARKERS, PLACEHOLDERS, Tokenizer, padded_vocab, tokenizer
from mmjax.models.tiny import tiny

TEXTS = ["the cat sat on the mat", "a red square on a grey background", "what colour is it",
         "It is blue.", "Describe the picture briefly please"] * 8

CONV = [{"from": "system", "value": "Be brief."},
        {"from": "human", "value": "<image>\nWhat colour is it?"},
        {"from": "gpt", "value": "It is blue."},
        {"from": "human", "value": "And the shape?"},
        {"from": "gpt", "value": "A square on the mat."}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer(write_tokenizer(str(tmp_path_factory.mktemp("tok")), TEXTS, 320))


def test_markers_are_single_special_ids(tok):
    base = tok.tok.get_vocab_size(with_added_tokens=False)
    ids = {tok.token_id(t) for t in list(MARKERS.values()) + list(PLACEHOLDERS.values())}
    assert len(ids) == 8 and min(ids) >= base - 5  # added after the trained vocabulary
    sp = tok.special_tokens()
    assert sp.bos == tok.token_id("<|begin_of_text|>") and sp.eos == tok.token_id("<|end_of_text|>")
    assert sp.delimiters("image") == (tok.token_id("<|image_start|>"), tok.token_id("<|image_end|>"))
    enc = tok.encode("a <image> cat")
    assert list(enc.ids).count(tok.placeholder_id("image")) == 1
    # Text never produces a marker id, and encoding round-trips.
    text = "the picture of a cat sat on a red mat"
    assert not set(tok.encode(text).ids.tolist()) & ids
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.vocab_size == max(tok.tok.get_vocab(with_added_tokens=True).values()) + 1


def test_padded_vocab():
    assert padded_vocab(300) == 384
    assert padded_vocab(384) == 384
    assert padded_vocab(129, (3,)) == 384  # lcm(128, 3)
    assert padded_vocab(1000, (1, 2, 6)) == 1152  # lcm(128, 6) = 384
    assert tokenizer(None) is None
    with pytest.raises(UserError, match="tokenizer.path"):
        tokenizer("/nonexistent/tok")


def test_llama3_render_matches_published_format(tok):
    fmt = ChatFormat(tok)  # the tokenizer's own chat_template (llama3)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}]
    want = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>")
    assert fmt.render(msgs) == want
    assert fmt.render(msgs, add_generation_prompt=True) == (
        want + "<|start_header_id|>assistant<|end_header_id|>\n\n")


def _trained_runs(ids, mask):
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(int(i))
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


@pytest.mark.parametrize("template,end", [("llama3", "<|eot_id|>"), ("qwen2", "<|im_end|>\n")])
def test_masks_exactly_on_assistant_turns(tok, template, end):
    fmt = ChatFormat(tok, template)
    chat = fmt(CONV)
    kinds = [p[0] for p in chat.pieces]
    assert kinds == ["text", "image", "text"]  # split at the placeholder
    ids = np.concatenate([p[1] for p in chat.pieces if p[0] == "text"])
    mask = np.concatenate([p[2] for p in chat.pieces if p[0] == "text"])
    assert ids[0] != tok.special_tokens().bos  # assembly writes bos itself
    runs = _trained_runs(ids, mask)
    assert [tok.decode(r, skip_special_tokens=False) for r in runs] == [
        "It is blue." + end, "A square on the mat." + end]
    # Everything else (system prompt, user turns, role headers) is untrained.
    rest = tok.decode(ids[~mask], skip_special_tokens=False)
    assert "Be brief." in rest and "What colour is it?" in rest and "It is blue" not in rest
    if template == "qwen2":  # a system turn given: no default system prompt
        assert "helpful assistant" not in rest


def test_qwen2_default_system_and_plain_and_all(tok):
    q = ChatFormat(tok, "qwen2", loss_on="all")
    text = q.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    chat = q([{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}])
    assert all(p[2] is None for p in chat.pieces)  # loss on all: no mask
    plain = ChatFormat(tok, "plain")
    assert plain.render([{"role": "user", "content": "<image>"},
                         {"role": "assistant", "content": "a cat"}]) == "<image>a cat\n"
    chat = plain([{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "a cat"}])
    assert [p[0] for p in chat.pieces] == ["image", "text"]
    assert tok.decode(chat.pieces[1][1][chat.pieces[1][2]]) == "a cat\n"


def test_hf_jinja_semantics(tok):
    custom = ("{% for m in messages %}\n  {% if m['role'] == 'system' %}"
              "{{ raise_exception('no system') }}{% endif %}\n{{ m['content'] }}\n{% endfor %}"
              "{% generation %}{{ eos_token }}{% endgeneration %}")
    fmt = ChatFormat(tok, custom, loss_on="all")
    # trim_blocks + lstrip_blocks: block tags leave no whitespace behind.
    assert fmt.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == (
        "a\nb\n<|end_of_text|>")
    with pytest.raises(ChatError, match="no system"):
        fmt([{"from": "system", "value": "x"}])
    with pytest.raises(ChatError, match="turn 0"):
        fmt([{"from": "robot", "value": "x"}])
    with pytest.raises(UserError, match="loss_on"):
        ChatFormat(tok, "plain", loss_on="prompt")


def test_assembly_trains_only_assistant_tokens(tok):
    cfg = tiny()
    layout = AssemblyLayout.from_config(cfg, 128, special=tok.special_tokens())
    layout = layout.__class__(**{**layout.__dict__, "vocab_size": padded_vocab(tok.vocab_size)})
    chat = ChatFormat(tok, "llama3")(CONV)
    segs = [Segment("text", p[1], loss_mask=p[2]) if p[0] == "text"
            else Segment("image", np.zeros((8, 12, 3), np.float32)) for p in chat.pieces]
    sample = Sample(3, tuple(segs))
    b = assemble([sample], layout)
    meta = layout.rules.meta(sample)
    ids = np.concatenate([p[1] for p in chat.pieces if p[0] == "text"])
    mask = np.concatenate([p[2] for p in chat.pieces if p[0] == "text"])
    assert b.num_target_tokens == int(mask.sum()) == meta.num_targets
    # The scored targets are exactly the trained text tokens, in order.
    scored = b.targets[0][b.loss_mask[0] > 0]
    np.testing.assert_array_equal(scored, ids[mask])
    sp = tok.special_tokens()
    assert b.tokens[0, 0] == sp.bos and sp.eos in b.tokens[0]
    assert sp.eos not in scored and sp.image_start not in scored


def test_model_vocabulary_covers_the_tokenizer(tok):
    from mmjax.models.config import with_overrides
    from mmjax.train.data_config import fit_vocab

    assert 256 < tok.vocab_size <= 384
    small = with_overrides(tiny(), {"llm.vocab_size": 128})
    assert fit_vocab(small, tok).llm.vocab_size == 384
    assert fit_vocab(small, tok, (1, 2, 6)).llm.vocab_size == 384  # lcm(128, 6) = 384
    assert fit_vocab(small, tok, (5,)).llm.vocab_size == 640  # lcm(128, 5)
    assert fit_vocab(tiny(), tok).llm.vocab_size == 512  # larger and aligned: kept
    assert fit_vocab(tiny(), tok, (3,)).llm.vocab_size == 384  # 512 is not a multiple of 3


@pytest.mark.parametrize("template", ["llama3", "qwen2", "plain"])
def test_named_templates_in_one_pass_equal_jinja_and_the_prefix_rule(tok, template):
    """The Python form of a named template (`COMPILED`: one pass per sample) gives the
    Jinja template's text and the prefix rule's assistant spans, on random conversations
    (system or not, repeated roles, empty and whitespace-padded turns, placeholders), and
    the formats' token masks agree with a format over an unnamed copy of the template."""
    from mmjax.data.chat import TEMPLATES, normalize_messages

    fmt = ChatFormat(tok, template)
    jinja_only = ChatFormat(tok, TEMPLATES[template] + "{# not a named template #}")
    assert fmt.compiled is not None and jinja_only.compiled is None
    rng = np.random.default_rng(0)
    words = ["hi", " padded \n", "<image>\nwhat?", "", "  ", "A red\nsquare.", "x<audio>y"]
    for _ in range(150):
        roles = ["system"] * int(rng.random() < 0.3) + [
            ("user", "assistant")[j % 2] if rng.random() < 0.8 else
            str(rng.choice(["user", "assistant"])) for j in range(int(rng.integers(1, 6)))]
        if roles[0] == "assistant":
            continue
        conv = [{"role": r, "content": str(rng.choice(words))} for r in roles]
        msgs = normalize_messages(conv)
        for gen in (False, True):
            full = fmt.render(msgs, gen)
            assert fmt.render_compiled(msgs, gen) == (full, fmt.assistant_spans(msgs, full))
        a, b = fmt(conv), jinja_only(conv)
        assert [(k, None if i is None else list(i), None if m is None else list(m))
                for k, i, m in a.pieces] == [
            (k, None if i is None else list(i), None if m is None else list(m))
            for k, i, m in b.pieces]
