"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): its bodies (body), their translation to chat
(translate), its answers (answer) and errors (errors); duo.api.http.anthropic routes it."""
