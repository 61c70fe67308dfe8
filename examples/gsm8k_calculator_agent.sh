#!/bin/sh
# An agent that is not Python: GSM8K with a calculator, in POSIX sh with curl and jq, trained by flatgrpo as a
# command (agent.py):
#   python grpo.py --config recipes/tiny_calculator_agent.yaml rollout.agent.path=null \
#       rollout.agent.command="sh examples/gsm8k_calculator_agent.sh"
# Each episode runs it once, the data row as one JSON line on stdin, OPENAI_BASE_URL and OPENAI_API_KEY set. It
# offers the model the calculator, runs each call itself (awk, on arithmetic characters only) and sends back the
# answer as a tool message, for up to three turns; it prints nothing, so the run's scorer (veRL's GSM8K rule)
# scores its last answer. A request the endpoint refuses makes curl fail, and the script with it: reward 0.
set -eu
row=$(cat)
api() {  # POST or GET $OPENAI_BASE_URL/$1 (with the JSON body $2)
    curl -sf -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
        ${2:+-d "$2"} "$OPENAI_BASE_URL/$1"
}
calculate() {  # an arithmetic expression's value, or what is wrong with it
    case "$1" in
        "" | *[!0-9.+*/%\(\)\ -]*) echo "Error executing tool 'calculator': not arithmetic: $1" ;;
        *) awk "BEGIN { print ($1) }" 2>/dev/null || echo "Error executing tool 'calculator': cannot evaluate $1" ;;
    esac
}
tools='[{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
  "parameters": {"type": "object", "required": ["expression"], "properties": {"expression": {"type": "string",
  "description": "Numbers, + - * / // % ** and brackets."}}}}}]'
model=$(api models | jq -r '.data[0].id')
messages=$(printf '%s' "$row" | jq -c '.prompt')
for turn in 1 2 3; do
    request=$(jq -nc --arg model "$model" --argjson messages "$messages" --argjson tools "$tools" \
        '{model: $model, messages: $messages, tools: $tools}')
    reply=$(api chat/completions "$request")
    message=$(printf '%s' "$reply" | jq -c '.choices[0].message')
    messages=$(printf '%s' "$messages" | jq -c --argjson m "$message" '. + [$m]')
    call=$(printf '%s' "$message" | jq -c '.tool_calls[0] // empty')
    if [ -z "$call" ] || [ "$(printf '%s' "$reply" | jq -r '.choices[0].finish_reason')" = length ]; then
        break
    fi
    expression=$(printf '%s' "$call" | jq -r '.function.arguments | fromjson? | .expression // "" | tostring')
    answer=$(calculate "$expression")
    messages=$(printf '%s' "$messages" | jq -c --arg id "$(printf '%s' "$call" | jq -r .id)" --arg answer "$answer" \
        '. + [{role: "tool", tool_call_id: $id, content: $answer}]')
done
