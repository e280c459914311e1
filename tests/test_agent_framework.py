"""A real agent framework drives the server: openai-agents on its chat-completions model, tracing off, runs a
Python tool that SmolLM2 is forced to call, feeds the result back and gets a final answer."""
import pytest

agents = pytest.importorskip("agents")

pytestmark = pytest.mark.slow


def test_openai_agents_runs_a_tool_loop_to_a_final_answer(server):
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is 18 degrees and sunny in {city}."

    class NoMoreToolsAfterTheFirst(agents.RunHooks):
        """A 135M model would call the tool turn after turn; once it ran, this client policy turns tools off
        (tool_choice "none"), so the next turn must be the model's answer."""

        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = agent.model_settings.resolve(agents.ModelSettings(tool_choice="none"))

    url, _ = server  # the default model's server the API tests share (tests/conftest.py)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIChatCompletionsModel(model="smollm2", openai_client=client)
    # tool_choice required on the first turn; the framework resets it to auto after the tool ran
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                         model=model, reset_tool_choice=False,
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4,
                                    hooks=NoMoreToolsAfterTheFirst())
    assert calls == ["Paris"], calls
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert "{" not in result.final_output[:1]  # the generic format's JSON wrapper never reaches the client
