"""OpenAI's Responses API (POST /v1/responses), served by translating it to the chat endpoint's requests."""

from duo.api.responses.body import ResponsesBody
from duo.api.responses.route import ResponsesApi, add_responses_routes

__all__ = ["ResponsesApi", "ResponsesBody", "add_responses_routes"]
