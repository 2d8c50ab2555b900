from atom_mistral_tools.hooks import MistralToolFormat


def test_parses_what_it_renders():
    fmt = MistralToolFormat()
    text = fmt.render_call("get_weather", {"city": "Paris", "days": 3})
    [call] = fmt.parse_region(text, at_end=True)
    assert (call.name, call.arguments) == ("get_weather", {"city": "Paris", "days": 3})


def test_a_prefix_is_not_a_call_yet():
    fmt = MistralToolFormat()
    text = fmt.render_call("get_weather", {"city": "Paris"})
    assert fmt.parse_region(text[:-3], at_end=False) is None


def test_quoted_marker_is_not_a_call():
    text = "[TOOL_CALLS] is how Mistral calls tools"
    assert MistralToolFormat().parse_region(text, at_end=True) is None
