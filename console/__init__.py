"""Operations console: a Streamlit app over SQL (read-only) and the gateway's admin JSON."""
