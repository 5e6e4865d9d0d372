"""`halfmoon soak`: the stack under hours of mixed traffic, cancels and faults; nothing may
grow without bound.

A run starts a local cluster with short retention (so SQL and JetStream reach their bound
within the run), sends mixed requests (chat and completions, streamed or not, n > 1,
structured output, clients that leave mid-request) and kills a part now and then. Every
`--sample-s` it records each process's RSS, open descriptors and threads, the SQL tables'
rows and the JetStream stream's size. It ends with a table of growth per hour, fitted by
least squares over the second half of the run, and fails (exit 1) on growth past the
tolerances, or on any hung or lost request.
"""
