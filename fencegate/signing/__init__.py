"""RFC 9421 request signatures with RFC 9530 content digests: the key ring the gateway trusts,
the check it runs before anything else, and the signer workers use."""
