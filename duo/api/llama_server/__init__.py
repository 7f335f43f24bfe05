"""llama-server's native endpoints (/completion, /infill, /tokenize, /detokenize, /apply-template): their bodies
(bodies) and the native answer (answer)."""
