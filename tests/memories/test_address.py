"""One way to write a memory and an edit: the command line, the explorer's URLs and forms, and the library read
the same text the same way, and the printer's text reads back as the same edit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ffkv.errors import FfkvError
from ffkv.explorer import validation
from ffkv.memories.address import MemoryRef, edit_label, edit_text, parse_edit, parse_edits
from ffkv.memories.interventions import Intervention

SHAPE = {"n_layers": 6, "d_m": 50}


def test_layers_count_from_one_in_text_and_from_zero_in_code():
    assert MemoryRef.parse("1:0", **SHAPE) == (0, 0) == MemoryRef(0, 0)
    assert MemoryRef.parse(" 6:49 ", **SHAPE) == MemoryRef(5, 49)
    assert str(MemoryRef(5, 49)) == "6:49"
    for text, message in (("0:1", "layer 0 does not exist"), ("7:1", "layers 1..6"), ("1:50", "keys 0..49"),
                          ("1:2:3", "LAYER:KEY"), ("a:1", "integers")):
        with pytest.raises(FfkvError, match=message):
            MemoryRef.parse(text, **SHAPE)


edits = st.builds(lambda layer, key, op, value: Intervention.scaled(layer, key, value) if op == "scale"
                  else Intervention(layer, key, op, value if op == "set" else 0.0),
                  st.integers(0, 5), st.integers(0, 49), st.sampled_from(["off", "scale", "set"]),
                  st.floats(-1e4, 1e4, allow_nan=False))


@given(edits)
def test_every_edit_reads_back_from_its_text(edit):
    op, text = edit_text(edit)
    assert parse_edit(op, text, **SHAPE) == edit
    # The explorer's URL parameter is the same text, and gives the same edit.
    assert list(validation.edits({op: [text]}, **SHAPE).values()) in ([edit], [])  # a scale of 1 is no edit there
    label = edit_label(edit)
    assert label == "off" if edit.op == "off" else label.startswith("×" if edit.op == "scale" else "=")


def test_the_command_and_the_explorer_read_the_same_edits():
    texts = {"off": ["3:17"], "scale": ["2:5=2"], "set": ["1:0=-4.5"]}
    command = parse_edits(texts["off"], texts["scale"], texts["set"], **SHAPE)
    explorer = validation.edits(texts, **SHAPE)
    assert sorted(command, key=lambda e: (e.layer, e.key)) == sorted(explorer.values(), key=lambda e: (e.layer, e.key))
    assert command == [Intervention(2, 17, "off"), Intervention(1, 5, "scale", 2.0), Intervention(0, 0, "set", -4.5)]
    # The trace form's per-memory fields read the same way; "off" (its checkbox) wins over a value typed beside it.
    form = validation.edits({"set:1:0": ["-4.5"], "scale:2:5": ["2"], "scale:3:17": ["9"], "off": ["3:17"],
                             "scale:4:4": [""]}, **SHAPE)
    assert form == {(0, 0): Intervention(0, 0, "set", -4.5), (1, 5): Intervention(1, 5, "scale", 2.0),
                    (2, 17): Intervention(2, 17, "off")}


def test_bad_edits_are_refused_with_one_line():
    for op, text, message in (("scale", "1:2", "LAYER:KEY=VALUE"), ("set", "1:2=abc", "must be a number"),
                              ("set", "1:2=inf", "finite"), ("off", "1:2=0", "without a value"),
                              ("grow", "1:2", "unknown edit")):
        with pytest.raises(FfkvError, match=message):
            parse_edit(op, text, **SHAPE)
    with pytest.raises(FfkvError, match="named twice"):
        parse_edits(["1:1"], ["1:1=2"], **SHAPE)
    with pytest.raises(validation.BadRequest, match="LAYER:KEY=VALUE") as caught:
        validation.edits({"scale": ["2:4:10"]}, **SHAPE)  # the old URL form is refused, not misread
    assert caught.value.status == 422
    with pytest.raises(validation.BadRequest, match="within"):
        validation.edits({"set": ["1:1=1e9"]}, **SHAPE)


LAYOUT_LATENTS = {2: ("transcoder", 40), 4: ("sae", 8)}


def test_a_latent_is_written_with_its_kind_and_reads_back():
    from ffkv.memories.address import LatentRef, MemoryLayout

    layout = MemoryLayout(6, 50, LAYOUT_LATENTS)
    assert layout.parse("t3:39") == LatentRef(2, 39, "transcoder") and str(LatentRef(2, 39, "transcoder")) == "t3:39"
    assert layout.parse(" s5:0") == LatentRef(4, 0, "sae") and str(layout.parse("s5:0")) == "s5:0"
    assert layout.parse("3:49") == MemoryRef(2, 49)  # a neuron is written as before
    for text, message in (("t1:0", "layer 1 has no dictionary: latents exist at t3, s5"),
                          ("t3:40", "t3 has latents 0..39"), ("s3:1", "is a transcoder, not a sae"),
                          ("t3:1:2", "tLAYER:LATENT"), ("t3:x", "integers"), ("t7:1", "layer 7 has no dictionary")):
        with pytest.raises(FfkvError, match=message):
            layout.parse(text)
    with pytest.raises(FfkvError, match="--dictionary"):
        MemoryLayout(6, 50).parse("t3:1")


@given(st.sampled_from(sorted(LAYOUT_LATENTS)), st.integers(0, 7))
def test_every_latent_address_reads_back_as_itself(layer, latent):
    from ffkv.memories.address import MemoryLayout

    layout = MemoryLayout(6, 50, LAYOUT_LATENTS)
    ref = layout.check_latent(layer, latent)
    assert layout.parse(str(ref)) == ref and ref.kind == LAYOUT_LATENTS[layer][0]


def test_the_explorer_reads_a_latent_edit_as_the_command_does():
    from ffkv.memories.address import LatentRef

    params = {"off": ["t3:12"], "scale": ["s5:3=2"], "set:t3:0": ["1.5"], "scale:t3:1": ["1"]}
    read = validation.edits(params, **SHAPE, latents=LAYOUT_LATENTS)
    assert read == {LatentRef(2, 12, "transcoder"): Intervention(2, 12, "off", kind="transcoder"),
                    LatentRef(4, 3, "sae"): Intervention(4, 3, "scale", 2.0, kind="sae"),
                    LatentRef(2, 0, "transcoder"): Intervention(2, 0, "set", 1.5, kind="transcoder")}
    assert sorted(read.values(), key=str) == sorted(parse_edits(["t3:12"], ["s5:3=2"], ["t3:0=1.5"], **SHAPE,
                                                                latents=LAYOUT_LATENTS), key=str)
    # a neuron and a latent with the same layer and number are two memories
    both = validation.edits({"off": ["3:12", "t3:12"]}, **SHAPE, latents=LAYOUT_LATENTS)
    assert len(both) == 2
    for params, message in (({"off": ["t4:12"]}, "--dictionary"), ({"scale": ["s2:3=2"]}, "--dictionary")):
        with pytest.raises(validation.BadRequest, match=message):
            validation.edits(params, **SHAPE)  # a run without a dictionary
    with pytest.raises(validation.BadRequest, match="t3 has latents 0..39"):
        validation.edits({"off": ["t3:40"]}, **SHAPE, latents=LAYOUT_LATENTS)


@pytest.mark.parametrize("text", ["1:1_0", "\uff11:1", "1:\uff11", "1:\u00b2", "1:\u0661", "1:+1", "1:-0", "1: ",
                                  "1:" + "1" * 100_000, "t3:1_0", "t\uff13:1", "t3:\u0661", "t3:+1",
                                  "t3:" + "1" * 100_000, "t" + "3" * 100_000 + ":1"])
def test_a_memorys_numbers_are_ascii_digits_and_a_refusal_quotes_them_short(text):
    """Python's int() reads "1_0" as 10 and other scripts' digits ("１", "١") as theirs, so "1:1_0" named memory
    1:10 and "t３:1" latent t3:1; a 100,000-digit key was quoted back whole. Every layer, key and latent a person
    writes is the digits 0-9, a few of them, and the refusal quotes a short prefix of what was given."""
    from ffkv.memories.address import MemoryLayout

    for read in (lambda: MemoryLayout(6, 50, LAYOUT_LATENTS).parse(text), lambda: MemoryRef.parse(text, **SHAPE),
                 lambda: parse_edit("off", text, **SHAPE, latents=LAYOUT_LATENTS),
                 lambda: validation.edits({"scale": [text + "=2"]}, **SHAPE, latents=LAYOUT_LATENTS)):
        with pytest.raises(FfkvError) as caught:
            read()
        message = str(caught.value)
        assert len(message) < 300 and "1" * 50 not in message and "3" * 50 not in message, message
        assert "digits 0-9" in message or "LAYER:KEY" in message, message


@pytest.mark.parametrize("layer, key", [("1_0", "1"), ("\uff11", "1"), ("1", "\u00b2"), ("1", "1_0"),
                                        ("1", "1" * 100_000), (" 1", "+1")])
def test_the_explorers_layer_and_key_are_read_as_everywhere(layer, key):
    """/memory/1/1_0 showed memory 1:10 (and /memory/１/1 memory 1:1): the explorer's numbers are read by the same
    rule as the command line's, its 404 quoting them short."""
    with pytest.raises(validation.BadRequest) as caught:
        validation.layer_key(layer, key, 6, 50)
    assert caught.value.status == 404 and len(str(caught.value)) < 300 and "digits 0-9" in str(caught.value)
    assert validation.layer_key(" 6", "49 ", 6, 50) == (5, 49) and validation.layer_key(1, 0, 6, 50) == (0, 0)


@pytest.mark.parametrize("op, text", [("scale", "1:2=1e308"), ("set", "t3:1=1e30"), ("set", "1:2=-10000.5"),
                                      ("scale", "1:2=nan"), ("set", "1:2=-inf")])
def test_an_edit_past_the_bound_is_refused_wherever_it_is_read(op, text):
    """The explorer bounded edits at ±1e4 while the command line let 1e308 through to overflow the model: the bound
    is the edit's own, so the command line's reading, the explorer's and the library's refuse it alike."""
    from ffkv.memories.interventions import MAX_EDIT_VALUE

    with pytest.raises(FfkvError, match="must be finite and within ±10000"):
        parse_edit(op, text, **SHAPE, latents=LAYOUT_LATENTS)
    with pytest.raises(validation.BadRequest, match="must be finite and within ±10000") as caught:
        validation.edits({op: [text]}, **SHAPE, latents=LAYOUT_LATENTS)
    assert caught.value.status == 422
    with pytest.raises(FfkvError, match="must be finite and within ±10000"):
        Intervention(0, 2, op, float(text.partition("=")[2]))
    assert parse_edit(op, f"1:2={-MAX_EDIT_VALUE:g}", **SHAPE).value == -MAX_EDIT_VALUE  # the bound itself is kept
