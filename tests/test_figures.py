"""The chapters' figures read on a phone (labkit.runtime.notebook): text below 7.5 CSS pixels
once a figure is shrunk to a 390-pixel screen's column is found, and plt.show() refuses the
figure, saying which text; the book's own style passes."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

# importing it sets the book's style, and its plt.show()
from labkit.runtime.notebook import phone_text_too_small, plt  # noqa: E402


@pytest.fixture(autouse=True)
def no_figures_left():
    yield
    plt.close("all")


def test_the_books_style_reads_on_a_phone_and_small_text_does_not():
    fig, ax = plt.subplots()   # 6 inches, 10-point ticks and labels, a 9.5-point key
    ax.plot([0, 1], [1, 0], label="a line")
    ax.set(xlabel="x", ylabel="y", title="title")
    ax.legend()
    assert phone_text_too_small(fig) == []
    ax.text(0.5, 0.5, "note", fontsize=8)   # 8 points over 6 inches: 6.6 pixels on a phone
    assert phone_text_too_small(fig) == [("note", 6.6)]
    narrow, ax = plt.subplots(figsize=(3, 2))   # as wide as the column or less: not shrunk
    ax.text(0.5, 0.5, "note", fontsize=8)
    assert phone_text_too_small(narrow) == []
    wide, ax = plt.subplots(figsize=(7.5, 2.6))   # the same point size, shrunk further
    assert all(px == pytest.approx(10 * 358 / (72 * 7.5), abs=0.05)
               for _, px in phone_text_too_small(wide))


def test_show_refuses_a_figure_with_text_too_small_and_shows_the_rest():
    fig, ax = plt.subplots()
    ax.set_xlabel("readable")
    plt.show()   # Agg shows nothing, and nothing was refused
    fig, ax = plt.subplots()
    ax.set_xlabel("too small", fontsize=7)
    with pytest.raises(AssertionError, match=r"\('too small', 5\.8\)"):
        plt.show()
