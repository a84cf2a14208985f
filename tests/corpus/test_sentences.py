import pytest

from ffkv.corpus import split_sentences


@pytest.mark.parametrize("text, expected", [
    ("Mr. Smith met Dr. Jones in the U.S. Army. They talked.",
     ["Mr. Smith met Dr. Jones in the U.S. Army.", "They talked."]),
    ("Use tools, e.g. hammers, i.e. heavy ones. Then stop.",
     ["Use tools, e.g. hammers, i.e. heavy ones.", "Then stop."]),
    ("J. R. R. Tolkien wrote it. H. G. Wells did not.", ["J. R. R. Tolkien wrote it.", "H. G. Wells did not."]),
    ("It grew 3.5 percent. Prices rose 2.75 points.", ["It grew 3.5 percent.", "Prices rose 2.75 points."]),
    ("It was 5 p.m. when we left.", ["It was 5 p.m. when we left."]),
    ("Wait... what? He left... The end.", ["Wait... what?", "He left...", "The end."]),
    ("Wait… What now?", ["Wait…", "What now?"]),
    ('He said "Go home." Then he left.', ['He said "Go home."', "Then he left."]),
    ("He said \u201cGo.\u201d She went.", ["He said \u201cGo.\u201d", "She went."]),
    ("(This is it.) And that.", ["(This is it.)", "And that."]),
    ("'Go.' She went.", ["'Go.'", "She went."]),
    ("Really?! Yes. No!", ["Really?!", "Yes.", "No!"]),
    ("No. 5 was here. I said no. Then I left.", ["No. 5 was here.", "I said no.", "Then I left."]),
    ("This is art. The next one is not.", ["This is art.", "The next one is not."]),
    ("lower case. after a period stays", ["lower case. after a period stays"]),
    ("No terminator at the end", ["No terminator at the end"]),
    ("   ", []),
])
def test_plain_text(text, expected):
    assert split_sentences(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("It is 3 @.@ 5 m long . The U.S. Army came . He said \" stop . \" Then it ended .",
     ["It is 3 @.@ 5 m long .", "The U.S. Army came .", "He said \" stop . \"", "Then it ended ."]),
    ("The crab ( H. gammarus ) is blue . It is red ( when cooked . ) Really ?",
     ["The crab ( H. gammarus ) is blue .", "It is red ( when cooked . )", "Really ?"]),
    ("He wrote : \" one . \" \" Two \" came next .",
     ["He wrote : \" one . \"", "\" Two \" came next ."]),
])
def test_wikitext_tokenized_form(text, expected):
    assert split_sentences(text) == expected


def test_sentences_are_a_partition_of_the_text():
    text = "A b. C d? E f! G h... I j."
    assert " ".join(split_sentences(text)) == text
