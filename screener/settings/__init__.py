"""Settings: every config table as a frozen dataclass, built strictly (an unknown key is an error) at load."""
