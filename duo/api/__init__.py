"""What clients of duo-target see, by protocol over one serving core: OpenAI's (openai), llama-server's
(llama_server), Anthropic's (anthropic) and OpenAI's Responses (responses) bodies and answers, over the stages every
request passes (serving) and the answer's text as deltas (output); the transports that carry them (http, grpc), tool
calls' formats (tools) and the chat page (page).

May import the target's loop (duo.target), duo.models and the shared modules at the top of duo; never
duo.cli, duo.bench or duo.draft.
"""
