"""What notebook and rank say to each other, defined once for both ends: the cell channel's
messages and their one codec (`wire`), set-up's (`handshake`), and values as frames (`frames`)."""

from nbdist.protocol.wire import VERSION, ProtocolError

__all__ = ["VERSION", "ProtocolError"]
