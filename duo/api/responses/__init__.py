"""OpenAI's Responses API (POST /v1/responses): its body (body), its translation to chat (translate), its answers
(answer, items) and the held conversations (store); duo.api.http.responses routes it."""
