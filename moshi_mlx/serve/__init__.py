"""The network: the connection guard every server shares, its HTTP helpers, and one folder per
protocol family."""
