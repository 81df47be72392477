"""Provider webhooks: verify, store raw, normalize into one vocabulary, apply once."""
