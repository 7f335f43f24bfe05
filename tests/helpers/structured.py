"""The pydantic schemas the structured-output tests ask for."""

from __future__ import annotations

import pydantic


# The tiny models write words: strings and numbers are bounded so that answers end.
Name = pydantic.constr(max_length=10)


class Address(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # as the SDK's strict schemas say: no other keys
    city: Name
    number: pydantic.conint(ge=0, le=999)


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: Name
    age: pydantic.conint(ge=0, le=120)
    address: Address
