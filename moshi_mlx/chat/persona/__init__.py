"""PersonaPlex's prompts: who Moshi is, given as a voice and a role before the conversation.

`schedule` lays out the prompt's frames as NVIDIA's generator feeds them, `voice` and `role`
read what the user chose, `prompt` turns them into a `GenState` with one batched prefill, and
`cache` keeps that state on disk so a prompt is computed once per weights, voice and role.
"""
