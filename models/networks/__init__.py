"""Networks written once against the layer context: the seed's MLP and a GPT."""
