"""The handles: a lease (Lock), its renewer, key/value and transactions."""
