import pytest

from ffkv.corpus import detokenize, heading_level


@pytest.mark.parametrize("line, level", [
    (" = Homarus gammarus = \n", 1),
    (" = = Life cycle = = ", 2),
    (" = = = Early years = = = ", 3),
    (" = M @-@ 82 ( Michigan highway ) = ", 1),
    (" = = Unbalanced = ", 0),
    (" Text with = signs = inside . ", 0),
    (" = = ", 0),
    ("", 0),
])
def test_heading_level(line, level):
    assert heading_level(line) == level


@pytest.mark.parametrize("tokenized, plain", [
    (" 0 @.@ 7 kg ( 1 @.@ 5 lb ) , and 1 @,@ 000 well @-@ known . ", "0.7 kg (1.5 lb), and 1,000 well-known."),
    ('the " crusher " ; it is : yes ! 5 % ?', 'the "crusher"; it is: yes! 5%?'),
    ("the lobster 's claw and the lobsters ' claws", "the lobster's claw and the lobsters' claws"),
    ("[ a ] { b }", "[a] {b}"),
])
def test_detokenize(tokenized, plain):
    assert detokenize(tokenized) == plain
