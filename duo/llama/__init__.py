"""The llama.cpp layer both processes stand on: a model and its contexts (model), the devices and ggml's RPC backend
(backends, rpc), the vocabulary a pair must share (vocab), the thread every model call runs on (worker).
It imports duo.sampling alone, never the floors above."""
