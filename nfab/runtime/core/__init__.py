"""The reduction core of one step: bucket plan -> encode and launch -> decode -> fold into statistics."""
