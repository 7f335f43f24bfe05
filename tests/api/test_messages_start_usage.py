"""A streamed Messages answer's message_start tells the prompt's tokens, as llama-server's does (its suite reads
input_tokens > 0 there): sent at once, before the prompt is read, and equal to what count_tokens counts;
message_delta then says which of them the cache held."""

from __future__ import annotations

from helpers.http import post, streamed

BODY = {"model": "duo", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello"}]}


def test_message_start_carries_the_prompts_tokens_and_message_delta_their_split(served_sync):
    counted = post(served_sync, "/v1/messages/count_tokens", {"messages": BODY["messages"]}).json()["input_tokens"]
    events = streamed(served_sync, "/v1/messages", BODY, done=False)
    assert events[0]["type"] == "message_start"
    start = events[0]["message"]["usage"]
    assert start["input_tokens"] == counted > 0 and start["output_tokens"] == 0
    [delta] = [event for event in events if event["type"] == "message_delta"]
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == counted
    assert delta["usage"]["output_tokens"] > 0
