// Swagger UI over the node's own OpenAPI document (served from the swagger-ui-bundle package).
// Under a proxy's sub-path (`root_path`, on <html> as `data-root`) the document is there too.
const root = document.documentElement.dataset.root || "";

// Its outline went from its h1 (the API's title) to an h3 per tag, a level skipped for a
// screen reader's list of headings: an h2 names the operations under the title.
const outlined = (system) => ({
  wrapComponents: {
    operations: (Original) => (props) => system.React.createElement(
      system.React.Fragment,
      null,
      system.React.createElement("h2", { className: "visually-hidden" }, "Operations"),
      system.React.createElement(Original, props),
    ),
  },
});

window.ui = SwaggerUIBundle({
  url: `${root}/openapi.json`,
  dom_id: "#swagger-ui",
  plugins: [outlined],
});
