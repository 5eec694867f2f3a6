"""`minigpt serve --adapter NAME=DIR` with odd names: a name that is blank or holds a control character is one
start-up error line (a newline split the start-up line that lists the adapters); a request naming an unknown model
is a 400 that quotes the name cut short, not the megabytes a client may send."""
import pytest
from conftest import assert_one_line_error, run_cli
from serve_helpers import chat_model

from minigpt.serve.models import resolve_model
from minigpt.serve.schemas import ApiError


@pytest.mark.parametrize("name", ["poet\nx", "tab\there", "   "])
def test_an_adapter_name_that_is_not_printable_text_is_a_start_up_error(tmp_path, name):
    model = chat_model(tmp_path)
    proc = run_cli("serve", model, "--port", "0", "--adapter", f"{name}=/nonexistent")
    assert_one_line_error(proc, "adapter name", "must be printable text, not blank")


def test_printable_names_with_spaces_and_other_scripts_are_served():
    assert resolve_model("a b", "base", ["a b", "ünï", "x?y#z"]) == "a b"
    assert resolve_model("ünï", "base", ["a b", "ünï", "x?y#z"]) == "ünï"


def test_an_unknown_model_is_quoted_cut_short():
    with pytest.raises(ApiError) as e:
        resolve_model("z" * 100_000, "base", ["poet"])
    err = e.value
    assert err.status == 400 and err.code == "model_not_found" and err.param == "model"
    assert "does not exist; this server serves 'base', 'poet'" in err.message and len(err.message) < 200
