"""The transforms a request can ask for, each in its own module, applied in one place on both sides: logit transforms
by the tokens before a row (penalties, dry: duo.sampling.rows.transform) and the shapes of a row's distribution
(truncation, xtc, temperature, mirostat, infill, over ranking's order: duo.sampling.distributions.distribution). They
import numpy and each other only."""
