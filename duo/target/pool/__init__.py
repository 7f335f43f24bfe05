"""The target's drafts: each a connection (dialed with --peer, or dialing in with duo-draft --join), one pool
placing every session on the draft where it adds the most, and moving it when a draft joins, falls behind or
is lost."""
